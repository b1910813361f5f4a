from services.task_executor.pool import create
from shared.runner import run_service

if __name__ == "__main__":
    run_service("task_executor", create)
