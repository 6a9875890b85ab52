import sys

from unclip.cli.train_decoder import main

sys.exit(main())
