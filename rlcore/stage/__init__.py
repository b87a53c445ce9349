"""The frame of a DVC stage script (``stages/``): its arguments, validated params, clean failures and outputs
(``frame``), and what a stage that trains, scores or evaluates does between parsing its arguments and its work:
its recorded inputs and its MLflow run (``run``). Light: nothing here imports torch, pandas, ray or MLflow."""
