"""π0 (`model.type: pi0`) over transformers' PI0ForConditionalGeneration, with the πRL samplers' path log-probs.

`flow.py`: the samplers' Gaussian transitions (pure torch); `inputs.py`: the PaliGemma prefix's inputs;
`policy.py`: `PI0Policy` (act, evaluate, values, predict_action, save_pretrained); `build.py`: strict loading of a
PI0 folder, tiny configurations. transformers is imported by policy.py and build.py only.
"""
