"""The notebooks' own pieces: running them with papermill, records, HTML/PDF handouts, plots and templates."""
