"""The ground floor: errors a person fixes, atomic files, output names, model sources, quiet logs, the environment check and what this CPU can do. Imports nothing else of helpers."""
