import sys

from unclip.cli import train_prior_script

sys.exit(train_prior_script())
