import sys

from gemmaforge.cli import main

sys.exit(main())
