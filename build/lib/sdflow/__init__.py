"""sdflow CLI and local runtime."""
