"""paper_tables: the paper's Tables 1-3 and Figures 2-6 regenerated from run results, with the
paper's numbers (paper_numbers.yaml) beside ours. `python -m paper_tables --help`; README.md."""
