"""Cloud TPU pods: the gcloud recipe (recipe.py) and the checks shared with the GKE manifest (common.py)."""
