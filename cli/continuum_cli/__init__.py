"""`continuum`: the operator's command. `up` runs the whole system locally; `migrate` runs one service's migrations."""
