import sys

from mok.cli import main

sys.exit(main())
