"""tandem_inference: controller, gateway, engine launcher and the transformers engine."""
