import sys

from tpspec.cli import main

sys.exit(main())
