import sys

from coopstudy import cli

sys.exit(cli.main(["bench", *sys.argv[1:]]))
