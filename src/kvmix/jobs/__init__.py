"""Running a command's jobs and keeping what they measured: grids of cells on Ray or here,
results files with their configuration, model, versions and machine, tables and plots."""
