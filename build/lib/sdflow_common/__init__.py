"""Code shared by every sdflow Lambda function (deployed as the CommonLayer)."""
