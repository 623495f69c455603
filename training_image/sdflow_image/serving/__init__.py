"""The inference server (SageMaker hosting): the model, its admission control, the HTTP app and workers."""
