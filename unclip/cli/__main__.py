import sys

from unclip.cli import main

sys.exit(main())
