"""The evaluation job (SageMaker processing): base against trained model on held-out prompts."""
