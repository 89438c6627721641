"""What the study trains and scores on: the seed model, generated tasks,
conversations, the chat rendering and the prepared, hashed inputs."""
