"""An example project outside litscale: a network and a data module of its own, trained by
litscale's ``train.py`` through configs in ``docs/examples/my_conf/`` (see
``docs/add-your-own-model.md``)."""
