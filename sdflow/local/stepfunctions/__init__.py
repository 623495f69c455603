"""Step Functions: the patches to moto's interpreter (LocalStack's) and API, and what they share."""
