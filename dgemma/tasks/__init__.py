"""Tasks the project trains and evaluates on, each independent of any model (see `sudoku`)."""
