"""The training program: config, mesh, model, data, state, the donated step and the loop."""
