import sys

from unclip.train.prior import main

sys.exit(main())
