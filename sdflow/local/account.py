"""The local cloud's one AWS account and region: moto's default account, and the region every
client of the local cloud is configured for. Every module of sdflow.local names them from here."""

ACCOUNT_ID = "123456789012"
REGION = "us-east-1"
