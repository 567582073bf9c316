"""User code: plugins named by a recipe, and code tests whose verdict the tested code
cannot forge.
"""
