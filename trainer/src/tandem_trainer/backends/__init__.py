"""Model runtimes a train job runs on: what they share (`base`), the two of them (`peft`,
`unsloth`) and how one is chosen (`select`).

Nothing is imported here: `peft` and `unsloth` pull in torch and transformers, and Unsloth
must be imported before transformers, so each caller imports the module it needs.
"""
