"""meshserve services: frontend, job_executor, cluster_manager, scaler, task_executor."""
