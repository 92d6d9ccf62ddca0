"""Integrations with other training stacks. Each submodule imports its framework, so import it by name only
where it is used: ``from lrmoe.integrations.torchtitan import convert_moe`` (needs ``pip install lrmoe[torchtitan]``).
"""
