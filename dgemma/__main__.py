import sys

from dgemma.cli import main

sys.exit(main())
