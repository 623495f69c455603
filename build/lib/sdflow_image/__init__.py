"""The training image's code: download, train and serve entrypoints (SageMaker contract)."""
