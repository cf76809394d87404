"""The HTTP layer: controllers, schemas and the error envelope."""
