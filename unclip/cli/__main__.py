from unclip.cli import console

console()
