"""consumers/engines"""
