import sys

from elastor.cli import main

sys.exit(main())
