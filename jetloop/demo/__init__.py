"""The bundled offline demo: a scripted model and tools against a small ticketing vendor."""
