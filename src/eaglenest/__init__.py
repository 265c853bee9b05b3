"""eaglenest: a DVC pipeline that trains EAGLE-3 draft models and measures their speed-up."""

__version__ = "0.1.0"
