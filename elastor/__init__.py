"""The `elastor` command line; it only parses arguments and dispatches to the other packages."""
