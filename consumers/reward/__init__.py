"""consumers/reward"""
