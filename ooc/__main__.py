import sys

from ooc.apps.cli import main

sys.exit(main())
