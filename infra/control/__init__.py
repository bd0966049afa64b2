"""Running a run: the launch from a recipe, the controller of the stage processes (Ray
actors), what runs a stage in its process (:mod:`relax.infra.control.runners`) and the
stages infra owns (eval, colocate), the watch of a running run (progress, stalls, stuck
rewards, errors), resume, scaling and its HTTP control API, core allocation and chaos.
Imports offline/, recipe/, observe/ and broker/, never cli/."""
