"""One module per step of the study; see coopstudy.cli."""
