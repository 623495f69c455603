"""The dedup job (SageMaker processing): the run's duplicate training samples, by URL and by pixels."""
