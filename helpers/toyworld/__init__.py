"""The toy world: a tiny text-to-image model trained here, so Textual Inversion visibly learns offline.

* :mod:`helpers.toyworld.world`: the procedural world (captioned 64 px scenes of toys) and Pip,
  the bundled concept, which the world never shows but is made of its parts (a teal duck).
* :mod:`helpers.toyworld.build`: ``python -m helpers.toyworld build`` trains a Stable Diffusion v1
  pipeline (same diffusers classes as the real one, tiny widths) and the judge on that world;
  ``--family sdxl`` builds its Stable Diffusion XL twin.
* :mod:`helpers.toyworld.graft`: how the SDXL twin starts from the SD v1 model's weights.
* :mod:`helpers.toyworld.judge`: the classifier that has seen Pip and scores generated pictures.
* :mod:`helpers.toyworld.evaluate`: ``python -m helpers.toyworld score``: Pip's probability over
  pictures generated from fixed seeds, with or without learned embeddings.

The built models ship in ``helpers/assets/toyworld`` and ``helpers/assets/toyworld-xl`` with their
manifests; ``models.resolve_model("toyworld")`` and ``("toyworld-xl")`` return those folders.
"""

from helpers.toyworld.evaluate import ConceptReport, before_training_report, concept_report, pip_score

__all__ = [
    "ConceptReport",
    "before_training_report",
    "concept_report",
    "pip_score",
]
