import sys

from coopstudy import cli

cli.entry(["bench", *sys.argv[1:]])
