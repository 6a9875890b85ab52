import sys
from unclip.train_prior import main
sys.exit(main())
