import sys

from unclip.cli.train_prior import main

sys.exit(main())
