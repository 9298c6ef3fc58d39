"""Textual Inversion: its settings (config), concept images (data), model loading (models), the engine and the entry point textual_inversion.train."""
