import sys

from patchset.cli import main

sys.exit(main())
