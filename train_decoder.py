import sys

from unclip.train.decoder import main

sys.exit(main())
