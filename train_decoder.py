import sys

from unclip.cli import train_decoder_script

sys.exit(train_decoder_script())
