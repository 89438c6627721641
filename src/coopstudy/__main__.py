from coopstudy.cli import entry

entry()
