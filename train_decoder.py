import sys
from unclip.train_decoder import main
sys.exit(main())
