"""Recipes: one YAML file that describes a whole run, with dotted ``key=value``
overrides; its sections made of the stages' own configs, the checks before launch
(preflight), and the stage processes a recipe makes with each one's config
(:mod:`relax.infra.recipe.specs`). The bottom floor of infra/: it imports no other
folder of infra/."""
