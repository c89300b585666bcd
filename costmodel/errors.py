"""The one exception type that users see.

Every problem with user input (a file, a flag, a plan) is raised as an `ElastorError` whose message
is one sentence naming the problem and, where there is one, the fix. The command line prints the
message and exits 2; anything else that escapes is a bug and keeps its traceback.
"""


class ElastorError(ValueError):
    """A user-facing error: one sentence, no traceback."""
